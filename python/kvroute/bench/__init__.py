"""Benchmarks as a product command: ``kvroute bench replay`` (the router on simulated engines, on
virtual time) and ``kvroute bench live`` (open-loop load against an OpenAI-compatible endpoint).

Both write the same report: JSON, a Markdown table and PNG plots (``report``).
"""
