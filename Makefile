.PHONY: test demo lint

# Sets up (Debian packages, .venv) and runs ruff, mypy, import-linter and pytest.
test:
	./scripts/test.sh

# Sets up and runs the main job.
demo:
	./scripts/demo.sh
