"""The mixture-of-experts block: its router (`router`) and its experts (`layer`)."""
