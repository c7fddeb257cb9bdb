"""The output-length predictor: MiniLM prompt embeddings, an MLP head conditioned on the served
model, and a nearest-neighbour history of finished requests, served over gRPC behind a query
cache (see docs/ARCHITECTURE.md, "The length predictor")."""
