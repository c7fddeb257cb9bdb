"""The GPU worker: model families and weight loading (`model/`), the engine that executes
step plans on a paged KV cache (`engine`), sampling (`sampler`), tokenization (`tokenizer`),
and the gRPC face (`server`)."""
