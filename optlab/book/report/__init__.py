"""Tables and figures built from summaries and stored records, so live runs and stored references look the same.

Every table a page shows goes through :func:`html_table` (:func:`set_theme` registers it with IPython): no 0..N
index column, three significant figures, "—" where a value is missing, and the columns that a table marks as
details in a collapsed block. The headline figure is :func:`plot_speedups`: speed-ups on a log axis with their
intervals, coloured by verdict, beside the seed's V100 speed-up.

The package's parts: ``text`` (numbers and verdicts as words), ``tables``, ``comparisons`` (ours beside the seed's and
the reference machines'), ``theirs`` (what others published, one block a chapter) and ``figures``; the names the chapters use are here.
"""
from ...core.measuring.timing import INTERVAL
from .text import COMPARED_WITH, noise_line, number, ratio, significant, speedup_text, verdict_text
from .tables import (
    DETAILS, GRAPHS_SKIPPED, SPEEDUP, comparison_table, html_table, in_order, linked_sources, set_theme,
    stack_table,
)
from .comparisons import (
    LIVE, SEED, reference_command, reference_comparison, reference_note, reference_summary, seed_comparison,
    speedups,
)
from .theirs import SUMMARY_COLUMN, PublishedBlock, published_block, summary_cell, summary_column
from .figures import (
    LEVEL_NAMES, VERDICT_COLOURS, legend_below, plot_batch_sizes, plot_breakdown, plot_learning,
    plot_memory_tradeoff, plot_numerics, plot_optimizer_steps, plot_speedups, plot_step_trace, plot_sweep,
    plot_waterfall,
)

__all__ = [
    'COMPARED_WITH', 'DETAILS', 'PublishedBlock', 'GRAPHS_SKIPPED', 'INTERVAL', 'LEVEL_NAMES', 'LIVE', 'SEED', 'SPEEDUP', 'SUMMARY_COLUMN',
    'VERDICT_COLOURS', 'comparison_table', 'html_table', 'in_order', 'legend_below', 'linked_sources', 'noise_line',
    'number', 'plot_batch_sizes', 'plot_breakdown', 'plot_learning', 'plot_memory_tradeoff', 'plot_numerics',
    'plot_optimizer_steps', 'plot_speedups', 'plot_step_trace', 'plot_sweep', 'plot_waterfall', 'published_block', 'ratio',
    'reference_command', 'reference_comparison', 'reference_note', 'reference_summary', 'seed_comparison',
    'set_theme', 'significant', 'speedup_text', 'speedups', 'stack_table', 'summary_cell', 'summary_column', 'verdict_text',
]
