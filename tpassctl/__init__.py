"""tpassctl: the torchpass command line for login nodes and admins."""
