"""The book's side: what a chapter calls (``chapter``), tables and plots (``report``), and the summary page.

Built from tidy samples and stored records, so live runs and stored GPU references look the same. Imports the core
and the studies; only ``optlab.commands`` and the notebooks import it.
"""
