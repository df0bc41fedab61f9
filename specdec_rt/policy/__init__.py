"""When speculation pays: acceptance tracking, costs, draft length, fallback, trees."""
