"""The router: the public `radixserve.v1.Router` service (tokenize, validate, admit, route, stream)."""
