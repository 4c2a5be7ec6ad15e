"""Benchmarks and load tools: run by hand or on a GPU machine, never as CI tests."""
