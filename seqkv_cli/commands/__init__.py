"""One small module per CLI command: parse, call library code, render with Rich."""
