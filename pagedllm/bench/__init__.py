"""Benchmarks that reproduce the PagedAttention paper's section 6: workloads (``datasets``),
latency / throughput metrics (``metrics``), the offline throughput run (``throughput``) and the
online client with Poisson arrivals (``serve``); ``pagedllm bench ...`` on the command line."""
