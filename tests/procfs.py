"""/proc/self/smaps, read by tests that check how memory is mapped (page sizes, advice)."""


def vma_fields(addr: int, size: int = 1) -> list[dict[str, str]]:
    """The smaps entries of this process's mappings overlapping [addr, addr + size): each a dict from field name
    (Rss, FilePmdMapped, VmFlags, ...) to the rest of its line."""
    out, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head, _, rest = line.partition(" ")
            if "-" in head and not head.endswith(":"):  # a mapping's first line: its address range
                a, b = (int(v, 16) for v in head.split("-"))
                cur = {} if a < addr + size and b > addr else None
                if cur is not None:
                    out.append(cur)
            elif cur is not None:
                cur[head.rstrip(":")] = rest.strip()
    return out


def rss_bytes(addr: int) -> int:
    """Resident bytes of the one mapping holding address addr (its smaps Rss)."""
    (vma,) = vma_fields(addr)
    return int(vma["Rss"].split()[0]) * 1024
