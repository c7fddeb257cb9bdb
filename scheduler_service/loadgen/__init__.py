"""The load generator behind `sluice bench` and the live benchmarks: a workload's requests sent
to a running scheduler (or any OpenAI-compatible server) and measured by the client with the
simulator's metric definitions.

    requests.py        BenchRequest (sized to the server's context), RequestRecord, prepare_requests
    load.py            run_requests: open loop at the arrival times, or closed loop; send_grpc
    openai_backend.py  OpenAIBench: the same requests over POST /v1/completions
    measure.py         record_metrics, summarize: the records as the simulator's SimRun
"""
