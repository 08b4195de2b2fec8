"""Context parallelism: each sequence split over the cp ranks (zigzag), ring attention."""
