"""Benchmarks as a library: measure schedules interleaved, write the dated reports.

Why a package of its own, above the engine and below the CLIs: ``oases-bench``,
``oases-plan mode=accuracy`` and ``benchmarks/validate_link.py`` all run the same
calibration, rank worker and record format, and the report generator reads what
they write.  None of that is argument handling, so none of it lives with the
CLIs; they compose a plain dict with Hydra and hand it here.

    spec        a plain config dict -> the validated spec the rank processes run
    measure     link calibration, the rank worker, ActivationProbe, the JSON record
    report      JSON lines -> dated Markdown reports and PNG plots
    provenance  what every record states about where it came from (git, machine)

Importing a module here imports no torch: the CLIs' up-front checks stay fast, and
the rank processes import it when they start.
"""
