from tests.one_thread import one_torch_thread  # noqa: F401 - autouse fixture
