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
    cost_model  the cost-model study: setups scored out of sample, stored runs pooled and
                priced by every stored profile, where a measured step goes
    memory      the memory model against ActivationProbe's measured peak on real ranks
    micro       kernel micro-benchmarks, variants interleaved round by round
    overhead    where a schedule spends CPU beyond ``none`` (per op kind and phase)
    e2e, netns, autotp   end to end on a ``tc``-shaped link between network namespaces,
                against DeepSpeed's AutoTP

``spec``, ``report``, ``provenance`` and ``netns`` import no torch, so the CLIs' up-front
checks stay fast; the measuring modules import it at the top.
"""
