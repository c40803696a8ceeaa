"""Fakes and harnesses for tests and benches: never imported by shared/ or services/."""
