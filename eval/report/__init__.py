"""Result tables and plots: collect runs from results/, compare with the paper, write Markdown/CSV/LaTeX/PNG/PDF.

    collect.py   finished runs, benchmark files and the paper's numbers -> tidy DataFrames
    methods.py   how methods are named and ordered, read from the registered classes (display_name, ...)
    tables.py    the paper's tables (Table 2, RULER) with per-cell deltas, and plain task tables
    plots.py     accuracy vs budget, accuracy vs TPOT, TT2T bars, TPOT breakdown, decode latency vs context
    summary.py   all of it into one directory (scripts/collect.py, notebooks/reproduce.ipynb)
"""
