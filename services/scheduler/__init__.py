"""The scheduler: knows the live workers from their heartbeats and routes each request to a pair."""
