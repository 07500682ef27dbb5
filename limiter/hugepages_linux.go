package limiter

import (
	"syscall"
	"unsafe"
)

// adviseHugePages asks Linux to back the table with 2 MiB pages where it
// can. A decision touches one random line of a table of many megabytes; with
// 4 KiB pages nearly every decision also misses the TLB, which costs as much
// as the cache miss itself. It is advice: on failure (or with transparent
// huge pages disabled) the table works the same, only slower.
func adviseHugePages(lines []line) {
	const huge = 2 << 20
	if len(lines)*64 < 2*huge {
		return
	}
	start := uintptr(unsafe.Pointer(&lines[0]))
	end := start + uintptr(len(lines))*64
	first := (start + huge - 1) &^ (huge - 1)
	last := end &^ (huge - 1)
	if last <= first {
		return
	}
	mem := unsafe.Slice((*byte)(unsafe.Add(unsafe.Pointer(&lines[0]), first-start)), last-first)
	_ = syscall.Madvise(mem, syscall.MADV_HUGEPAGE)
}
