"""servelab-spf: a shortest-prompt-first scheduler plugin for servelab."""
