"""Command-line tools (``heterospec demo | generate | calibrate | bench | train-draft``): they import the
rest of the package and nothing imports them."""
