"""Generated gRPC stubs of proto/tandem/v1/tandem.proto (made by proto/codegen.py, `make proto`)."""
