"""A deployed run's own traffic, stored for training (art_ray/feedback.py has the types)."""
