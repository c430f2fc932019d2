"""The public test kit, accord.testing."""
