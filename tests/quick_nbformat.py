"""A pytest plugin, loaded before nbval by ``addopts`` in pyproject.toml, that keeps ``nbformat`` quick to import.

nbformat validates notebooks with jsonschema, whose format checker imports ``rfc3987_syntax`` for the ``iri`` formats
wherever it is installed (JupyterLab's dependencies install it). That package builds 35 Earley parsers as it is
imported: 3.6 s on two cores, in every pytest process, one per chapter under nbval (python-jsonschema/jsonschema#1428).
No notebook schema uses those formats, so the import is refused here and jsonschema leaves them unchecked.
"""
import sys

sys.modules.setdefault("rfc3987_syntax", None)
