"""Test support shared by several test folders (importable: pytest puts tests/ on sys.path)."""
