"""Shared pieces of every radixserve process; `radixserve.v1` holds the generated gRPC stubs (`make proto`)."""
