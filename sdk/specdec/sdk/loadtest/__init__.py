"""`specdec loadtest`: the gateway under load, from the client side (torch-free).

Fixed concurrency levels or Poisson arrival rates; several speculation modes per level,
interleaved; per level and mode the request and token throughput, TTFT / TPOT / ITL /
end-to-end latency percentiles (vLLM ``benchmark_serving`` names), acceptance, tokens per
round, SSD hit rate and errors by gRPC code; ``--check-exact`` compares every greedy
response under load with the same request run alone at k = 0.

Imports grpcio, protobuf and the standard library only; the PNG chart imports matplotlib
when it is drawn (``pip install 'specdec-sdk[loadtest]'``).
"""
