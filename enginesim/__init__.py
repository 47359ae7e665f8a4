"""Emulated SGLang-style prefill and decode engines for running the stack without GPUs."""
