"""The application around the library: the run driver (config -> model, method, task -> results/), provenance of
every result file, and the report (tables and plots from finished runs). The library (``icecache``) imports
nothing from here."""
