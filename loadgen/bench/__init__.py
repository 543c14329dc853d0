"""`dasc-bench`: matched-budget and refresh-cost serving experiments on real dasc-serve arms."""
