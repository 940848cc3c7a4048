"""Serving on modelled hardware: the price of an engine step (:mod:`.step_cost`) and its
physical floors (:mod:`.floors`), workloads (:mod:`.workload`), the SimPy serving
simulator with replicas, routers and disaggregated pools (:mod:`.simulator`), the metrics
as ``vllm bench serve`` defines them (:mod:`.metrics`), and a deployment priced end to end
(:mod:`.deployment`: what ``vcluster simulate serve`` runs). The schedulers it imitates
are pure, in :mod:`serving`. docs/serving.md explains the model."""
