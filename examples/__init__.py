"""Short radixserve.lang programs, each runnable against `make run`: `.venv/bin/python examples/<name>.py [router]`."""
