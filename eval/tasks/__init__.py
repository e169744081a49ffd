"""The tasks, one file per family, with their metrics; ``eval.plugins`` imports them all, which registers them."""
