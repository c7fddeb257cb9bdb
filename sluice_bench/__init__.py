"""The benchmark harness: what every script under benchmarks/ is built from.

    options.benchmark_parser(__doc__)     a benchmark's parser, its docstring as --help
    options.add_common_options(parser)    --json PATH, --plot PATH, --seeds, --first-seed, --jobs, --ray
    sweep.run_sweep(fn, points, seeds)    independent simulations, serially, in local processes or as
                                          Ray tasks; results in the same order, identical to the serial run
    report.write_json / print_table / plot_lines
                                          one JSON writer (DESIGN.md's schema for simulation runs), one
                                          table printer, one plot helper
    repro                                 the papers' claims as data and the runs that reproduce them
    live                                  services as child processes for the live benchmarks
    fault_harness, vllm_plugin_harness    live pieces shared by the fault suite's tests and benchmark,
                                          and by the vLLM plug-in's tests and benchmark

Layering: it may import services/, scheduler_service/, worker_service/ and sluice/ (like
services/); nothing but benchmarks/ and tests/ imports it.
"""
