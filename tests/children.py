"""A line a child Python runs first so that only its import path can find optlab: an editable install's finder
(which would find the right optlab whatever the path says) is taken off ``sys.meta_path``."""
WITHOUT_INSTALLED_OPTLAB = ("import sys; sys.meta_path[:] = [finder for finder in sys.meta_path "
                            "if 'editable' not in repr(finder).lower()]; sys.modules.pop('optlab', None)")
