"""What the tests share: helpers, and the harnesses and stand-ins some of them drive
(a headless browser, a desktop, a crash seam, a Ray cluster, notification receivers)."""
