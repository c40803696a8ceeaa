"""Generated gRPC stubs of proto/tandem/v1/tandem.proto (see codegen.py)."""
