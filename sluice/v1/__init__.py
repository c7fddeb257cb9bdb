"""Generated gRPC code of the sluice.v1 protos (make protos). Do not edit."""
