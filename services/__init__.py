"""Tandem's services: gateway, scheduler, prefill and decode, each runnable as `python -m services.<name>`."""
