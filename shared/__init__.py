"""Tandem's shared library: settings, wire messages, transports, model loading and the engine."""
