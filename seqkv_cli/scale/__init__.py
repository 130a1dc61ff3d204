"""Scale-out: session datasets compressed into shards grouped by shared prefix, serially
(local.py) or on Ray Data (ray_data.py), with a manifest tying the shards together."""
