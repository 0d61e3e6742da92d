"""Read (and so execute) the summary page after every chapter: it reads the records the chapters write."""

LAST = "book/summary"


def read_summary_last(app, env, docnames: list[str]) -> None:
    """Sphinx reads ``docnames`` in list order, and this event may reorder the list in place."""
    if LAST in docnames:
        docnames.remove(LAST)
        docnames.append(LAST)


def setup(app):
    app.connect("env-before-read-docs", read_summary_last)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
