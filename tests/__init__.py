"""accord's test suite, a package: test modules import their helpers from `tests.helpers`."""
