# A package, so that the "package"-scoped server fixtures in conftest.py are torn down after the
# last e2e test instead of idling (and spinning CPU) through the rest of the test session.
