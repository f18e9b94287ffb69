.PHONY: test demo

# The README's two commands, for those who have make.
test:
	scripts/test.sh

demo:
	scripts/demo.sh
