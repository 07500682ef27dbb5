package inprocess

import (
	"context"
	"maps"
	"sync"

	"github.com/caddyserver/caddy/v2"
)

func init() {
	caddy.RegisterModule(eventRecorder{})
}

// eventRecorder is the events handler floodgate_test_recorder: it keeps the
// data of every event it is given, with the event's name under "event".
type eventRecorder struct{}

var recorded struct {
	sync.Mutex
	events []map[string]any
}

func (eventRecorder) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "events.handlers.floodgate_test_recorder",
		New: func() caddy.Module { return new(eventRecorder) },
	}
}

func (eventRecorder) Handle(_ context.Context, e caddy.Event) error {
	data := map[string]any{"event": e.Name()}
	maps.Copy(data, e.Data)
	recorded.Lock()
	defer recorded.Unlock()
	recorded.events = append(recorded.events, data)
	return nil
}

// Events returns the events recorded since the last call, and forgets them.
func Events() []map[string]any {
	recorded.Lock()
	defer recorded.Unlock()
	events := recorded.events
	recorded.events = nil
	return events
}
