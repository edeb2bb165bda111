"""The one-shot model jobs as library functions: a config in, a model folder (or a report) out.

* :func:`~cast_llm.jobs.prune.prune_job` — ``cast-llm prune`` (:class:`cast_llm.prune.config.PruneConfig`);
* :func:`~cast_llm.jobs.quantize.quantize_job` — ``cast-llm quantize`` (:class:`cast_llm.quant.config.QuantizeConfig`);
* :func:`~cast_llm.jobs.export.export_job` — ``cast-llm export`` (:class:`cast_llm.deploy.config.ExportConfig`);
* :func:`~cast_llm.jobs.bench.bench_job` — ``cast-llm bench-inference`` (:class:`cast_llm.deploy.config.BenchInferenceConfig`).

Each config lives in the package of its concept and the command line only parses flags into it and calls the
job. The jobs live here, one floor above those packages, because each loads a model (:mod:`cast_llm.models`,
which imports :mod:`cast_llm.quant` and :mod:`cast_llm.deploy` to load their checkpoints, which in turn use
:mod:`cast_llm.prune`): inside any of them a job would close a package cycle.
"""
