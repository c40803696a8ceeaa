"""Several hosts on one machine: Linux network namespaces on one switch, a NATS cluster across
them, and Tandem's services spread over them (test_multihost.py)."""
