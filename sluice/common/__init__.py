"""The ground floor every service stands on: config, paths, telemetry, gRPC bootstrap, the
Python client. Imports none of the service packages."""
