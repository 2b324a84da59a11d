"""trajstore's trainer side: replay recorded samples into tensor batches."""
