"""Emit sphinx-thebe's inline config script once per page, not twice.

sphinx-thebe adds ``<script>const THEBE_JS_URL = ...</script>`` from an ``env-before-read-docs`` handler, after the
HTML builder exists. Sphinx 7 stores such an inline script in the builder as filename ``None``, then adds the
registry's copy again as ``''`` when it prepares writing; the two do not compare equal, so every page declares the
``const`` twice and the browser reports a SyntaxError. Registered at ``config-inited``, before the builder exists,
the script reaches the builder only through the registry, once.
"""
import sphinx_thebe


def register_before_builder(app, config) -> None:
    sphinx_thebe.init_thebe_default_config(app, None, None)
    sphinx_thebe.init_thebe_core(app, None, None)


def setup(app):
    app.setup_extension("sphinx_thebe")
    for listener in list(app.events.listeners["env-before-read-docs"]):
        if listener.handler is sphinx_thebe.init_thebe_core:
            app.disconnect(listener.id)
    app.connect("config-inited", register_before_builder)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
