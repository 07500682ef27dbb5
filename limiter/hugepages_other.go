//go:build !linux

package limiter

func adviseHugePages([]line) {}
